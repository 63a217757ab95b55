"""The swap planner: profile a warm-up, predict step time and memory per tier, pick per-block policies."""

from .cost import WEIGHT_TIERS, BlockProfile, Prediction, Profile, Timings, predict, torch_step
from .solver import (ONE_SLOT_HINT, Plan, PlanError, fixed_plan, holds_state_in_ram, one_slot, one_slot_faster, solve,
                     with_one_slot, worth_one_slot)
from .spec import HARDWARE_PRESETS, MODEL_PRESETS, Hardware, ModelSpec, analytic_profile

__all__ = ["BlockProfile", "HARDWARE_PRESETS", "Hardware", "MODEL_PRESETS", "ModelSpec", "ONE_SLOT_HINT", "Plan",
           "PlanError", "Prediction", "Profile", "Timings", "WEIGHT_TIERS", "analytic_profile", "fixed_plan",
           "holds_state_in_ram", "one_slot", "one_slot_faster", "predict", "solve", "torch_step", "with_one_slot",
           "worth_one_slot"]
