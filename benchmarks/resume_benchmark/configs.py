"""The benchmark's built-in ``pretrain_gpt.py`` configurations: one per load path of the build.

Each configuration is Megatron-LM arguments for one optimizer mode, added to the arguments of a
model size (:data:`SIZES`). Its :class:`Expectation` says what ``--check`` holds the build to:
``ADOPTS`` (the default adopter installs the FP32 moments by reference: the load peak falls by
8 B x parameters, within the uninterrupted run's training peak) or ``KEEPS_LOADER`` (the
default adopter declines; the build's load peak equals upstream's). An adopter beyond
:data:`DEFAULT_ADOPTERS` that handled the state on the build side (an opt-in plugin) makes the
saving measured, not predicted. This module imports neither torch nor Megatron.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

#: One FP32 ``exp_avg`` plus one FP32 ``exp_avg_sq`` element: what the build avoids per parameter.
FP32_MOMENT_PAIR_BYTES: Final = 8

#: The state adopters the ``+stateadoption`` build registers by itself (no plugin installed).
DEFAULT_ADOPTERS: Final[tuple[str, ...]] = ("te_fused_adam_fp32", "te_fused_adam_bf16")

_GPT: Final = (
    "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--tokenizer-type", "NullTokenizer",
    "--transformer-impl", "transformer_engine", "--seed", "1234",
)  # fmt: skip


def _size(
    layers: int, hidden: int, heads: int, seq: int, batch: int, vocab: int
) -> tuple[str, ...]:
    return (
        "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--ffn-hidden-size", str(4 * hidden), "--num-attention-heads", str(heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        "--micro-batch-size", "2", "--global-batch-size", str(batch),
        "--vocab-size", str(vocab), *_GPT,
    )  # fmt: skip


#: Model sizes: ``1b`` (1,076,899,840 parameters, Megatron's max allocated ~24.8 GB on an H200),
#: ``small`` (~0.2 B: several configurations side by side on one GPU within minutes) and
#: ``tiny`` (smoke runs; too small for ``--check``'s 1 % tolerance).
SIZES: Final[Mapping[str, tuple[str, ...]]] = {
    "1b": _size(20, 2048, 16, 2048, 16, 32000),
    "small": _size(12, 1024, 16, 1024, 8, 50304),
    "tiny": _size(2, 256, 4, 256, 4, 1024),
}


class Expectation(enum.Enum):
    """What the build does with a configuration's optimizer state at load time."""

    ADOPTS = "the default adopter installs the FP32 moments by reference"
    KEEPS_LOADER = "the default adopter declines: TE's or the optimizer's own loader"


@dataclass(frozen=True)
class Configuration:
    """One optimizer mode: its ``pretrain_gpt.py`` arguments and what the build does with it."""

    name: str
    arguments: tuple[str, ...]
    expectation: Expectation
    description: str
    #: The FFN width as a multiple of the size's hidden size (None: the size's 4 x hidden).
    ffn_hidden_size_ratio: float | None = None
    #: Why upstream's own resume differs from the uninterrupted run (an upstream bug the build
    #: fixes); ``--check`` then reports upstream's differences and requires the build's none.
    upstream_divergence: str | None = None

    def script_arguments(self, size: str) -> list[str]:
        """The model size's arguments (its FFN width scaled here) followed by this mode's."""
        size_arguments = list(SIZES[size])
        if self.ffn_hidden_size_ratio is not None:
            hidden = int(size_arguments[size_arguments.index("--hidden-size") + 1])
            ffn = size_arguments.index("--ffn-hidden-size") + 1
            size_arguments[ffn] = str(int(hidden * self.ffn_hidden_size_ratio))
        return [*size_arguments, *self.arguments]


_DISTRIBUTED: Final = ("--bf16", "--use-distributed-optimizer")
_PRECISION_AWARE: Final = (
    *_DISTRIBUTED, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
    "--exp-avg-sq-dtype", "bf16",
)  # fmt: skip
#: A Llama-style GPT: SwiGLU's linear_fc1 is saved through a ShardedTensorFactory (two halves).
_LLAMA: Final = (
    "--swiglu", "--group-query-attention", "--num-query-groups", "4", "--normalization",
    "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
)  # fmt: skip
#: A Qwen2-style GPT: as Llama's, but with biases on the query, key and value projections only,
#: two query groups and tied embeddings.
_QWEN: Final = (
    "--swiglu", "--group-query-attention", "--num-query-groups", "2", "--normalization",
    "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear", "--add-qkv-bias",
)  # fmt: skip
_ADOPTS, _KEEPS = Expectation.ADOPTS, Expectation.KEEPS_LOADER

#: Every built-in configuration, in the order ``all`` runs them.
CONFIGURATIONS: Final[Mapping[str, Configuration]] = {
    c.name: c
    for c in (
        Configuration(
            "dp-reshardable", _DISTRIBUTED, _ADOPTS,
            "BF16, distributed optimizer, torch_dist dp_reshardable (Megatron-LM's default)",
        ),
        Configuration(
            "fully-reshardable", (*_DISTRIBUTED, "--dist-ckpt-optim-fully-reshardable"), _ADOPTS,
            "the same, optimizer state saved fully_reshardable",
        ),
        Configuration(
            "moe",
            (*_DISTRIBUTED, "--num-experts", "4", "--moe-ffn-hidden-size", "2048",
             "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear"),
            _ADOPTS, "4 experts, top-2, SwiGLU without biases (the experts' fused probability "
            "scaling needs both): a ChainedOptimizer of a dense and an expert optimizer",
        ),
        Configuration(
            "megatron-fsdp",
            (*_DISTRIBUTED, "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
             "--data-parallel-sharding-strategy", "optim_grads_params"),
            _ADOPTS, "Megatron-FSDP (optim_grads_params), fsdp_dtensor checkpoint",
        ),
        Configuration(
            "non-distributed-bf16", ("--bf16",), _ADOPTS,
            "BF16 without the distributed optimizer: Float16OptimizerWithFloat16Params",
        ),
        Configuration(
            "non-distributed-fp32", (), _ADOPTS,
            "FP32 without the distributed optimizer: FP32Optimizer",
        ),
        Configuration(
            "precision-aware", _PRECISION_AWARE, _KEEPS,
            "precision-aware optimizer, BF16 moments, TE master weights with remainders",
        ),
        Configuration(
            "llama", (*_DISTRIBUTED, *_LLAMA), _ADOPTS,
            "Llama-style: SwiGLU (FFN 3.5 x hidden, as Llama 3 and Mistral), GQA with 4 groups, "
            "RMSNorm, RoPE, untied embeddings, no biases; BF16, distributed optimizer",
            ffn_hidden_size_ratio=3.5,
        ),
        Configuration(
            "qwen", (*_DISTRIBUTED, *_QWEN), _ADOPTS,
            "Qwen2-style: SwiGLU (FFN 5.43 x hidden, as Qwen2.5-0.5B's 4864 / 896), GQA with 2 "
            "groups, biases on Q, K and V only, RMSNorm, RoPE, tied embeddings; BF16, "
            "distributed optimizer",
            ffn_hidden_size_ratio=4864 / 896,
        ),
        Configuration(
            "cpu-offload",
            (*_DISTRIBUTED, "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
             "--optimizer-offload-fraction", "1.0"),
            _KEEPS, "optimizer state on the host (HybridDeviceOptimizer)",
            upstream_divergence=(
                "upstream's dp_reshardable load writes the load template's Adam step (1, not "
                "saved) back over the checkpoint's after load_state_dict set it, so its resume "
                "restarts Adam's bias correction (NVIDIA/Megatron-LM#1842); the build keeps the "
                "loaded step (patches/0006)"
            ),
        ),
    )
}  # fmt: skip


#: What runs without ``--configs``: every configuration, each measured on an H200
#: (docs/gpu-report.md).
DEFAULT_CONFIGURATIONS: Final = tuple(CONFIGURATIONS)


def extra_adopters(adopters: Iterable[str] | None) -> tuple[str, ...]:
    """The adopters in ``adopters`` beyond :data:`DEFAULT_ADOPTERS`, in order, without repeats."""
    return tuple(dict.fromkeys(a for a in adopters or () if a not in DEFAULT_ADOPTERS))


def parse_configurations(text: str) -> list[str]:
    """``all`` (alone: it already runs every configuration) or comma-separated names of
    :data:`CONFIGURATIONS`, each once.

    Raises:
        ValueError: for an unknown or repeated name, ``all`` beside names, or an empty list.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(CONFIGURATIONS)
    choices = "choose from all, " + ", ".join(CONFIGURATIONS)
    if "all" in names:
        others = ", ".join(n for n in names if n != "all")
        raise ValueError(
            f"'all' runs every configuration ({others} included); give all alone or a list of "
            "names"
        )
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown or not names:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown) or '(none)'}; {choices}")
    repeated = [n for n in dict.fromkeys(names) if names.count(n) > 1]
    if repeated:
        raise ValueError(f"configuration(s) given more than once: {', '.join(repeated)}")
    return names
