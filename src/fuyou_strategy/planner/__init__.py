"""The swap planner: profile a warm-up, predict step time and memory per tier, pick per-block policies."""

from .cost import WEIGHT_TIERS, BlockProfile, Prediction, Profile, predict, torch_step
from .solver import Plan, PlanError, fixed_plan, solve
from .spec import HARDWARE_PRESETS, MODEL_PRESETS, Hardware, ModelSpec, analytic_profile

__all__ = ["BlockProfile", "HARDWARE_PRESETS", "Hardware", "MODEL_PRESETS", "ModelSpec", "Plan", "PlanError",
           "Prediction", "Profile", "WEIGHT_TIERS", "analytic_profile", "fixed_plan", "predict", "solve", "torch_step"]
