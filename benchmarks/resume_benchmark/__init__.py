"""Checkpoint-resume memory benchmark: upstream megatron-core 0.19.2 vs. ``+stateadoption``.

Run it from the repository root with ``python -m benchmarks.resume_benchmark --help``.

Layout (one concern per module):

* :mod:`.cli` / :mod:`.__main__` -- command line and exit codes.
* :mod:`.preflight` -- cheap checks (CUDA, Transformer Engine) before any heavy work.
* :mod:`.sides` -- where each side's ``megatron-core`` comes from (directory, wheel, download).
* :mod:`.driver` -- runs every phase of every case in a fresh worker process.
* :mod:`.launch` -- process layout (``--nproc-per-node``, TP, EP, resume DP size), its
  validation and the phase command (plain or ``torch.distributed.run``; no torch import).
* :mod:`.multirank` -- runs one case's phases on several ranks and collects every rank's result.
* :mod:`.rank_summary` -- per-rank results of one multi-rank case -> its report entry.
* :mod:`.gathered` -- DP-size-independent fingerprint for a resume at another DP size.
* :mod:`.worker` -- one phase (probe, train+save+control, resume) in one process.
* :mod:`.adoption` -- the registered state adopters and which one installed the state during a
  resume's load (log records of the state-adoption loader; no torch import).
* :mod:`.cases` -- model sizes, presets and the measured cases (no torch import).
* :mod:`.runtime` -- ``torch.distributed``/Megatron initialisation (one rank or a ``torchrun``
  rank) and determinism.
* :mod:`.model` -- :func:`~.model.build_gpt_and_optimizer`.
* :mod:`.training` -- deterministic synthetic batches and one training step.
* :mod:`.checkpoint` -- ``torch_dist`` save and the timed load, as Megatron's checkpointing does.
* :mod:`.fingerprint` -- bitwise (SHA-256) fingerprints of model and optimizer state.
* :mod:`.results` -- result records and their comparison (no torch import).
* :mod:`.report` -- the Markdown table and the JSON document.
"""
