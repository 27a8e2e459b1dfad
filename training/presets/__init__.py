"""Task presets: the papers' recipes (``table``) and the resolver that fills a TrainConfig
from defaults, presets, a resumed run or config file, and flags (``resolve``)."""

from .resolve import CHOSEN, DEFAULT, FLAG, Kind, Provenance, preset_tasks, resolve, show
from .table import PRESETS, Rule, derive

__all__ = ["CHOSEN", "DEFAULT", "FLAG", "PRESETS", "Kind", "Provenance", "Rule", "derive",
           "preset_tasks", "resolve", "show"]
