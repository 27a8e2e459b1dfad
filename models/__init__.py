"""orthornn's model zoo: every architecture of the papers behind one registry.

    from orthornn.models import ARCHITECTURES, build_model
    model = build_model("svdrnn", task="classify", input_size=1, hidden_size=64, num_outputs=10)
"""

from .networks import TASKS, spectral_summary
from .registry import ALIASES, ARCHITECTURES, Architecture, build_model

__all__ = ["ALIASES", "ARCHITECTURES", "TASKS", "Architecture", "build_model", "spectral_summary"]
