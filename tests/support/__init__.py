"""What the test modules share and only they use: the pool of real gloo ranks that runs a test body
on N processes (:mod:`support.multirank`), the GradScaler's layouts (:mod:`support.amp_layouts`),
the spike policy's training runs and their one-process replica (:mod:`support.spike_runs`), the
copies' bound runs (:mod:`support.copies_bound`), and the host-sync trace on fake CUDA tensors
(:mod:`support.sync_trace`, :mod:`support.sync_paths`, with the no-op CUDA guard it builds,
``noop_cuda_guard.cpp``). pytest puts ``tests/`` on ``sys.path``, and the rank pool hands its
workers the same path, so a body defined here is found by name on every rank. The workloads the
benchmark uses too are in ``testbed/`` at the repository's root.
"""
