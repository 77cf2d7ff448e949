"""The model architectures: one folder each (config, weight schema, engine, graph wiring),
listed in ``registry``."""
