"""Memory accounting, all of it: a model's memory spec (from its config.json or its checkpoint's headers), the
ledger that turns spec, settings and device into named lines, and the advice when it does not fit.

  errors.py   BudgetError, SpecError
  quant.py    quantization schemes and what a tensor of each costs
  spec.py     ModelMemorySpec; spec_from_config (an estimate from config.json)
  headers.py  spec_from_checkpoint (exact bytes from safetensors headers / GGUF tensor infos)
  load.py     load_spec (which of the two a path gets), default_model_path
  lines.py    each consumer line of the ledger
  advice.py   the fixes a refusal names; option_costs
  fit.py      the settings not given, fitted to the device where the defaults do not fit (before any refusal)
  ledger.py   Budget, plan_budget, measure_vs_predicted

It imports nothing of deltaserve but config and, inside the header readers, weights/ (docs/architecture.md: a leaf that
everyone may import).
"""

from deltaserve.budget.advice import OptionCost, option_costs
from deltaserve.budget.errors import BudgetError, SpecError
from deltaserve.budget.headers import spec_from_checkpoint
from deltaserve.budget.ledger import Budget, BudgetLine, LineCheck, measure_vs_predicted, plan_budget
from deltaserve.budget.lines import CONSUMER_LINES, POOL_LINES, has_mtp_head, serves_images
from deltaserve.budget.load import default_model_path, load_spec
from deltaserve.budget.quant import QuantScheme, parse_quant
from deltaserve.budget.spec import ModelMemorySpec, VisionShape, WeightGroup, spec_from_config

__all__ = ["Budget", "BudgetError", "BudgetLine", "CONSUMER_LINES", "LineCheck", "ModelMemorySpec", "OptionCost",
           "POOL_LINES", "QuantScheme", "SpecError", "VisionShape", "WeightGroup", "default_model_path",
           "has_mtp_head", "load_spec", "measure_vs_predicted", "option_costs", "parse_quant", "plan_budget",
           "serves_images", "spec_from_checkpoint", "spec_from_config"]
