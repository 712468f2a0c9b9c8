"""Checkpoint-resume memory benchmark: upstream megatron-core V vs. this ``V+stateadoption`` build.

Run it from the repository root with ``python -m benchmarks.resume_benchmark --help``.

Layout (one concern per module):

* :mod:`.cli` / :mod:`.__main__` -- command line and exit codes.
* :mod:`.preflight` -- cheap checks (CUDA, Transformer Engine) before any heavy work.
* :mod:`.sides` -- where each side's ``megatron-core`` comes from (directory, wheel, download)
  and whether the two are comparable (build ``V+stateadoption``, upstream exactly ``V``).
* :mod:`.driver` -- one case as one story: train+save+control, resume upstream, resume build,
  each phase a fresh launch on the layout's ranks; collects every rank's result.
* :mod:`.launch` -- process layout (``--nproc-per-node``, TP, EP, resume DP size), its
  validation and the phase command (plain on one rank, ``torch.distributed.run`` on several).
* :mod:`.summary` -- every rank's results of one case -> its report entry and the ``--check``
  verdict (no torch import).
* :mod:`.gathered` -- DP-size-independent fingerprint for a resume at another DP size.
* :mod:`.worker` -- one phase (probe, train+save+control, resume) on one rank.
* :mod:`.adoption` -- the registered state adopters and the structured outcome of every
  state-adoption hook point during a resume's load, on every rank (no torch import).
* :mod:`.instance_loader` -- ``--instance-loader bridge-like``: an instance-level
  ``load_state_dict`` on every inner FusedAdam for a resume's load, counted.
* :mod:`.cases` -- model sizes, presets and the measured cases (no torch import).
* :mod:`.runtime` -- ``torch.distributed``/Megatron initialisation of a rank, and determinism.
* :mod:`.model` -- :func:`~.model.build_gpt_and_optimizer`.
* :mod:`.training` -- deterministic synthetic batches and one training step.
* :mod:`.checkpoint` -- ``torch_dist`` save and the timed load, as Megatron's checkpointing does.
* :mod:`.fingerprint` -- bitwise (SHA-256) fingerprints of model and optimizer state.
* :mod:`.results` -- result records and their comparison (no torch import).
* :mod:`.report` -- the Markdown table and the JSON document; merging several runs' documents.
"""
