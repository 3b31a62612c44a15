"""The model's speed-ups, behind interfaces: what makes the reference path fast on a CPU.

The reference files (``engine/model/attention.py``, ``layers.py``, ``llama.py`` and the other
model families) read as plain torch and import nothing from here; the pieces here plug in
through the interfaces those files define (a test holds the rule,
``tests/e2e/test_import_rules.py``):

- ``attention_backends.py``: the ``PAGED_INDUCTOR`` and ``CPU_PAGED_CPP`` attention backends
  (``AttentionBackend``, chosen by name in ``engine/model/attention_selector.py``);
  ``paged_attention_cpu.py`` builds and calls the C++ kernel of ``csrc/``.
- ``linear.py``: linear weights pre-packed for oneDNN, and bfloat16 linears run natively or
  as float32 matmuls, whichever measured faster (``CPUPackedLinearMethod``, a
  ``LinearMethodBase``); ``measured_choice.py`` times such candidates on this machine once
  and caches the verdict; ``prefill_attention.py`` chooses the same way whether a bfloat16
  model's prefill attention runs in float32 (``engine.model.attention.sdpa_upcast_on_cpu``).
- ``compile.py``: the forward through ``torch.compile`` and its ``glassbox::attention`` op.
- ``op_threads.py``: the thread count of a step's parallel work, which the worker's thread
  governor (``engine/worker/cpu/``) lowers while other processes take its CPUs.

``compile.py`` and ``PAGED_INDUCTOR`` run on any device; they are here because they were
written and measured for the CPU build (docs/performance.md) and are not the reference.
"""
