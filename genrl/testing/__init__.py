"""Support for genrl's tests and benchmarks: tiny random-weight pipelines (``tiny_pipelines``).

Nothing here is used by training or evaluation; the trainer's no-argument run uses the
shipped toy model in ``genrl/assets/toy-shapes-t2i``.
"""
