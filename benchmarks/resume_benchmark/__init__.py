"""Checkpoint-resume memory benchmark in Megatron-LM's own training loop: upstream megatron-core
V vs. this ``V+stateadoption`` build. Run it from the repository root with
``python -m benchmarks.resume_benchmark --help``.

Layout (one concern per module):

* :mod:`.cli` / :mod:`.__main__` -- command line, exit codes, the preflight checks.
* :mod:`.configs` -- the built-in ``pretrain_gpt.py`` configurations and model sizes.
* :mod:`.megatron_lm` -- one configuration's four runs of ``pretrain_gpt.py`` and their
  comparison (losses, checkpoints).
* :mod:`.megatron_lm_probe` -- the observer inside each rank (load peak, outcomes, timeline).
* :mod:`.sides` / :mod:`.side_probe` -- where each side's ``megatron-core`` comes from, what it
  imports, and whether the two compare.
* :mod:`.driver` -- one launch in fresh processes, its log and every rank's result.
* :mod:`.memory_timeline` / :mod:`.figures` -- the load's allocated memory over time, from
  torch's allocator trace, and its figures.
* :mod:`.results` -- result files, progress lines and the state-adoption records.
* :mod:`.report` -- the Markdown report and what ``--check`` requires.
"""
