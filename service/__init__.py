"""The inference service (FastAPI + onnxruntime). Never imports torch."""
