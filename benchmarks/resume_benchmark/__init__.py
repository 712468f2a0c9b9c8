"""Checkpoint-resume memory benchmark: upstream megatron-core V vs. this ``V+stateadoption`` build.

Run it from the repository root with ``python -m benchmarks.resume_benchmark --help``; on your
own training, ``python -m benchmarks.resume_benchmark megatron-lm --help``.

Layout (one concern per module):

* :mod:`.cli` / :mod:`.__main__` -- command line, exit codes, the preflight checks.
* :mod:`.megatron_lm` / :mod:`.megatron_lm_probe` -- Megatron-LM's ``pretrain_gpt.py`` as the
  training loop: the client's runs and report, and the observer inside each rank.
* :mod:`.sides` -- where each side's ``megatron-core`` comes from and whether the two compare.
* :mod:`.driver` -- one case as one story: train+save+control, resume upstream, resume build.
* :mod:`.launch` -- process layout, its validation and the phase command.
* :mod:`.summary` -- every rank's results of one case -> its report entry and verdict.
* :mod:`.worker` -- one phase (probe, train+save+control, resume) on one rank.
* :mod:`.instance_loader` -- ``--instance-loader bridge-like``.
* :mod:`.cases` -- model sizes, presets and the measured cases.
* :mod:`.runtime` -- rank initialisation, determinism, :func:`~.runtime.measured_peak`.
* :mod:`.model` -- the GPT, its optimizer, and one training step.
* :mod:`.checkpoint` -- ``torch_dist`` save and the load, as Megatron's checkpointing does.
* :mod:`.fingerprint` -- bitwise fingerprints, per rank and gathered across DP sizes.
* :mod:`.memory_timeline` / :mod:`.figures` -- the load's allocated memory over time, from
  torch's allocator trace, and its figures.
* :mod:`.results` -- result files, the state-adoption records and digest comparison.
* :mod:`.report` -- the Markdown table and the JSON document; merging several runs' documents.
* :mod:`.call_sites` -- the other Megatron-Core load call sites (Megatron-FSDP, no DistOpt).
"""
