"""The application on the library: training configs and data, the training job,
planning from configs, ``simulate``, ``show`` and the ``embshard`` command line (its
``bench`` runs the benchmark, tools/bench/ of the source checkout). Nothing below
imports it."""
