"""Workloads the test suite and the benchmark share, one copy for both.

The layouts of one small model on real ranks (:mod:`testbed.layouts`), the collectives counted on
one rank of a simulated world (:mod:`testbed.fake_world`), Llama-like gradients at world scale and
the wire of a call (:mod:`testbed.world_layouts`), and the peak extra memory of a call
(:mod:`testbed.memory`). The tests import them through pytest's ``pythonpath`` (the repository's
root, in ``pyproject.toml``); ``benchmarks/run.py`` and ``benchmarks/digests_on_gpu.py`` put the
root on ``sys.path``. Not part of the installed package; nothing here imports from ``tests/`` or
``benchmarks/``.
"""
