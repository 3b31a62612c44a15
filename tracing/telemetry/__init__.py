"""Live telemetry: what each process is doing *now*, published as it happens.

- ``events``: every event type (the wire contract), gauge names, the per-process address,
  the recording format.
- ``state``: ``LiveState``, one instance as engine-top shows it, built from the events.

Imports no ``engine`` module and no torch.
"""
