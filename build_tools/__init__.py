"""Build helpers that compose the ``megatron-core`` wheel from the upstream wheel.

Nothing here is shipped in the wheel; ``setup.py`` imports these modules at build time.
"""
