"""The torch half of export/: a training run in, a model package out.

``exporter`` (the export command's steps: load the run, build, check, gate, publish),
``onnx_export`` (the ONNX graph of a model), ``functions`` and ``graph`` (the
``ai.orthornn`` functions and the graph builder), ``evaluation`` (the held-out score the
gate compares). Writes packages with ``..artifacts``; the service never imports this.
"""
