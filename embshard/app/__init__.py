"""The application on the library: training configs and data, the training job,
planning from configs, ``simulate``, ``show``, the benchmark and the ``embshard``
command line. Nothing below imports it."""
