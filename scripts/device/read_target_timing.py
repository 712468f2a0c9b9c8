# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""A GPU probe: how long Megatron-Core's ``torch_dist`` load takes to read one rank's Adam
moments (FP32 in the checkpoint, Qwen2.5-0.5B's parameter shapes) into each kind of read target,
alone on the GPU, each kind in turn, repeated.

    torchrun --nproc-per-node 1 scripts/device/read_target_timing.py --dir /tmp/rt --json-out X

Targets: separate FP32 tensors (upstream's FP32 state); FP32 views of one allocation (the FP32
adopter's initialization); separate BF16 tensors (the precision-aware adopter's held moments: the
CPU casts them); FP32 tensors cast to BF16 on the GPU afterwards (upstream's precision-aware
read, ``get_unscaled_state`` then ``set_scaled_state``); and, through torch DCP directly, BF16
tensors read through one pinned host buffer and cast on the GPU in 16 MiB chunks. With
``--cpu-busy N``, N processes keep CPU cores busy during the reads.
"""

import argparse
import json
import multiprocessing
import os
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

CHUNK_BYTES = 16 << 20


def qwen_shapes(layers: int = 24, hidden: int = 896, ffn: int = 4864, heads: int = 14,
                groups: int = 2, vocab: int = 151936) -> List[Tuple[int, ...]]:
    """The parameter shapes of a Qwen2.5-0.5B-like GPT (Megatron's fused QKV and fc1)."""
    qkv = hidden + 2 * groups * (hidden // heads)
    layer = [(hidden,), (qkv, hidden), (qkv,), (hidden, hidden), (hidden,), (2 * ffn, hidden),
             (hidden, ffn)]
    return [(vocab, hidden)] + layer * layers + [(hidden,)]


class HostScratchPlanner(DefaultLoadPlanner):
    """Reads a tensor whose target has another dtype into a pinned host buffer of the stored
    dtype, then copies it to the target in chunks, casting on the GPU."""

    def __init__(self, scratch: torch.Tensor) -> None:
        super().__init__()
        self.scratch = scratch
        self.pending: Dict[int, torch.Tensor] = {}

    def resolve_tensor(self, read_item):  # type: ignore[no-untyped-def]
        target = super().resolve_tensor(read_item)
        stored = self.metadata.state_dict_metadata[read_item.dest_index.fqn].properties.dtype
        if target.dtype == stored or not target.is_cuda:
            return target
        self.pending[id(read_item)] = target
        return self.scratch.view(stored)[: target.numel()].view(target.shape)

    def commit_tensor(self, read_item, tensor):  # type: ignore[no-untyped-def]
        target = self.pending.pop(id(read_item), None)
        if target is not None:
            flat, source = target.view(-1), tensor.reshape(-1)
            step = CHUNK_BYTES // source.element_size()
            for start in range(0, flat.numel(), step):
                flat[start : start + step].copy_(source[start : start + step], non_blocking=True)
            torch.cuda.current_stream(target.device).synchronize()  # the scratch is reused next
            tensor = target
        super().commit_tensor(read_item, tensor)


def _spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="where the probe's checkpoint is written")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--json-out", required=True)
    parser.add_argument("--cpu-busy", type=int, default=0,
                        help="processes that keep a CPU core busy during the reads, as other "
                             "ranks of a node do")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()  # without a GPU: a smoke run of the code on the CPU
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.optimizer.state_adoption.allocation import packed_zeros

    shapes = [s for s in qwen_shapes(args.layers) for _ in range(2)]  # exp_avg, exp_avg_sq
    keys = [f"state.{i}" for i in range(len(shapes))]
    elements = sum(torch.Size(s).numel() for s in shapes)
    generator = torch.Generator(device=device).manual_seed(0)
    source = [torch.randn(s, generator=generator, device=device) * 1e-3 for s in shapes]
    mcore_dir, dcp_dir = os.path.join(args.dir, "mcore"), os.path.join(args.dir, "dcp")
    os.makedirs(mcore_dir, exist_ok=True)

    def sharded(tensors: List[torch.Tensor]) -> Dict[str, ShardedTensor]:
        return {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in zip(keys, tensors)}

    if cuda:  # megatron-core's save synchronizes CUDA
        dist_checkpointing.save(sharded(source), mcore_dir)
    dcp.save(dict(zip(keys, source)), checkpoint_id=dcp_dir)
    expected_bf16 = [t.bfloat16() for t in source]
    del source

    def empty(dtype: torch.dtype) -> List[torch.Tensor]:
        return [torch.empty(s, dtype=dtype, device=device) for s in shapes]

    def mcore_read(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        loaded = dist_checkpointing.load(sharded(tensors), mcore_dir)
        return [loaded[k] for k in keys]

    def cast_after(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        held = empty(torch.bfloat16)
        for index, fp32 in enumerate(mcore_read(tensors)):
            held[index].copy_(fp32.bfloat16())
        return held

    scratch_elements = max(torch.Size(s).numel() for s in shapes)
    scratch = torch.empty(scratch_elements, dtype=torch.float32, pin_memory=cuda)

    def dcp_read(tensors: List[torch.Tensor], planner=None) -> List[torch.Tensor]:  # type: ignore[no-untyped-def]
        state = dict(zip(keys, tensors))
        dcp.load(state, storage_reader=FileSystemReader(dcp_dir), planner=planner)
        return [state[k] for k in keys]

    variants: Dict[str, Tuple[Callable[[], List[torch.Tensor]], Callable[[], List[torch.Tensor]]]] = {
        "mcore: FP32 tensors (upstream FP32)": (lambda: empty(torch.float32), mcore_read),
        "mcore: FP32 views of one allocation (FP32 adopter)": (
            lambda: packed_zeros([torch.empty((), device=device).expand(s) for s in shapes],
                                 torch.float32),
            mcore_read,
        ),
        "mcore: BF16 tensors (precision-aware adopter)": (lambda: empty(torch.bfloat16), mcore_read),
        "mcore: FP32 tensors, cast to BF16 on the GPU after (upstream precision-aware)": (
            lambda: empty(torch.float32), cast_after),
        "dcp: FP32 tensors": (lambda: empty(torch.float32), dcp_read),
        "dcp: BF16 tensors": (lambda: empty(torch.bfloat16), dcp_read),
        "dcp: BF16 tensors through a pinned host buffer, cast on the GPU": (
            lambda: empty(torch.bfloat16), lambda t: dcp_read(t, HostScratchPlanner(scratch))),
    }
    results: Dict[str, List[Dict[str, float]]] = {name: [] for name in variants}
    spinners = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
                for _ in range(args.cpu_busy)]
    for spinner in spinners:
        spinner.start()
    if not cuda:
        variants = {name: v for name, v in variants.items() if name.startswith("dcp")}
    for name, (make, read) in variants.items():  # warm the page cache and the code paths
        if "FP32 tensors" in name:
            read(make())
    for repeat in range(args.repeats):
        for name, (make, read) in variants.items():
            try:
                targets = make()
            except Exception as error:  # one variant's failure leaves the others to run
                print(f"{name}: {type(error).__name__}: {error}", flush=True)
                continue
            synchronize()
            base = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            try:
                loaded = read(targets)
            except Exception as error:
                print(f"{name}: {type(error).__name__}: {error}", flush=True)
                continue
            synchronize()
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() - base if cuda else 0
            if loaded[0].dtype == torch.bfloat16:
                exact = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                            for a, b in zip(loaded, expected_bf16))
            else:
                exact = all(torch.equal(a.bfloat16().view(torch.int16), b.view(torch.int16))
                            for a, b in zip(loaded, expected_bf16))
            results[name].append({"seconds": seconds, "peak_over_targets_MiB": peak / 2**20,
                                  "matches_checkpoint": exact})
            print(f"{repeat} {name}: {seconds:.2f} s, peak +{peak / 2**20:,.1f} MiB, ok {exact}", flush=True)
            del targets, loaded
    for spinner in spinners:
        spinner.terminate()
    summary = {
        "cpu_busy_processes": args.cpu_busy,
        "elements": elements, "tensors": len(shapes), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "results": results,
    }
    with open(args.json_out, "w") as f:
        json.dump(summary, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
