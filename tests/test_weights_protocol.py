"""`optim.weights.StreamedWeights` (what the optimizer needs of streamed weights) against `WeightStreamer`, the
one implementation: every member there with parameters the optimizer's calls fit, and no streamer in optim/
typed ``Any`` any more (issue 52)."""

import ast
import inspect
import typing
from pathlib import Path

import pytest
import torch

from fuyou_strategy import FuyouConfig
from fuyou_strategy.optim import weights
from fuyou_strategy.optim.weights import StreamedWeights
from fuyou_strategy.params import DeviceMeter, WeightStreamer

OPTIM = Path(__file__).resolve().parent.parent / "src" / "fuyou_strategy" / "optim"


def _methods(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def _fits(declared: inspect.Signature, actual: inspect.Signature) -> list[str]:
    """How ``actual`` fails calls written against ``declared``: a declared parameter missing or of another kind
    (keyword-only, positional, ...), or a parameter the protocol does not declare that has no default."""
    problems = []
    have = actual.parameters
    for name, p in declared.parameters.items():
        if name not in have:
            problems.append(f"no parameter {name!r}")
        elif have[name].kind is not p.kind:
            problems.append(f"{name!r} is {have[name].kind.description}, declared {p.kind.description}")
    if list(n for n in have if n in declared.parameters) != list(declared.parameters):
        problems.append(f"parameters in another order: {list(have)} against {list(declared.parameters)}")
    problems += [f"{name!r} has no default" for name, p in have.items() if name not in declared.parameters
                 and p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return problems


@pytest.mark.parametrize("protocol, implementation", [
    (weights.StreamedWeights, WeightStreamer), (weights.DeviceBytes, DeviceMeter)], ids=["streamer", "meter"])
def test_the_implementation_has_every_method_with_fitting_parameters(protocol, implementation):
    declared = _methods(protocol)
    assert declared, f"{protocol.__name__} declares no method"
    problems = {name: _fits(sig, inspect.signature(getattr(implementation, name))) if hasattr(implementation, name)
                else ["missing"] for name, sig in declared.items()}
    assert {name: p for name, p in problems.items() if p} == {}


def test_the_updates_gates_have_every_method_with_fitting_parameters():
    from fuyou_strategy.optim.distributed import _SentWeights
    from fuyou_strategy.optim.schedule import PendingUpdates

    for gate in (PendingUpdates, _SentWeights):
        problems = {name: _fits(sig, inspect.signature(getattr(gate, name))) for name, sig in
                    _methods(weights.UpdatesGate).items()}
        assert {name: p for name, p in problems.items() if p} == {}, gate.__name__


def test_a_streamer_has_the_attributes_and_satisfies_the_protocol():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    streamer = WeightStreamer(model, FuyouConfig(), blocks=list(model))
    attributes = set(typing.get_type_hints(StreamedWeights)) - set(_methods(StreamedWeights))
    assert attributes == {"meter", "updates"}
    assert all(hasattr(streamer, name) for name in attributes)
    assert isinstance(streamer.meter, DeviceMeter)  # the class checked against DeviceBytes above
    assert isinstance(streamer, StreamedWeights)


def test_the_signature_check_sees_drift():
    def declared(self, param, k, values): ...

    def renamed(self, param, chunk, values): ...

    def required_extra(self, param, k, values, stream): ...

    def optional_extra(self, param, k, values, *, stream=None): ...

    sig = inspect.signature(declared)
    assert _fits(sig, inspect.signature(renamed))
    assert _fits(sig, inspect.signature(required_extra))
    assert _fits(sig, inspect.signature(optional_extra)) == []


def _any_typed_streamers(tree: ast.AST) -> list[str]:
    """Parameters and ``self.`` attributes named ``streamer``/``weights`` annotated ``Any`` (or left bare)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if arg.arg in ("streamer", "weights") and (arg.annotation is None or "Any" in ast.unparse(arg.annotation)):
                    found.append(f"{node.lineno} {node.name}({arg.arg})")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
            if node.target.attr in ("streamer", "weights") and "Any" in ast.unparse(node.annotation):
                found.append(f"{node.lineno} {ast.unparse(node.target)}")
    return found


def test_no_streamer_in_optim_is_typed_any():
    found = [f"{path.name}:{hit}" for path in sorted(OPTIM.glob("*.py")) for hit in _any_typed_streamers(
        ast.parse(path.read_text()))]
    assert found == []


def test_no_streamer_in_optim_is_typed_any_but_adamw_s():
    found = [f"{path.name}:{hit}" for path in sorted(OPTIM.glob("*.py")) if path.name != "adamw.py"
             for hit in _any_typed_streamers(ast.parse(path.read_text()))]
    assert found == []


def test_the_any_check_sees_each_kind():
    tree = ast.parse("def f(self, streamer: Any, weights, other: Any): ...\n"
                     "def g(self, streamer: StreamedWeights): self.weights: Any = None\n")
    assert _any_typed_streamers(tree) == ["1 f(streamer)", "1 f(weights)", "2 self.weights"]
