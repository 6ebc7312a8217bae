"""sakura_torch.blocks: the one block-stack selection every package uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sakura.options import OptionError

torch = pytest.importorskip("torch")
nn = torch.nn

from sakura_torch.blocks import describe_selector, find_blocks, validate_selector  # noqa: E402


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.small = nn.ModuleList([Block(), Block(), Block()])
        self.layers = nn.ModuleList([Big(), Big()])
        self.head = nn.Linear(4, 1)


def names(found: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in found]


def test_auto_detection_picks_the_stack_with_most_parameters() -> None:
    assert names(find_blocks(Model())) == ["layers.0", "layers.1"]
    # a stack of bare Linears is not a block stack
    with pytest.raises(OptionError, match="found no repeated block stack in Sequential"):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))


@pytest.mark.parametrize(
    "selector", [Block, (Block,), "Block", lambda n, m: n.startswith("small.")]
)
def test_explicit_selectors_take_the_outermost_match(selector: object) -> None:
    # with the callable, "small.0.inner" matches too, inside the selected "small.0"
    assert names(find_blocks(Model(), selector)) == ["small.0", "small.1", "small.2"]


def test_bad_selectors_name_the_option() -> None:
    with pytest.raises(OptionError, match=r"Pager: blocks=3 is not accepted; accepted: None"):
        validate_selector(3, owner="Pager")
    with pytest.raises(OptionError, match=r"blocks=<class 'int'> is not accepted"):
        validate_selector(int)
    with pytest.raises(OptionError, match="blocks='' is not accepted"):
        validate_selector("")
    with pytest.raises(OptionError, match="Nope matched no module of Model"):
        find_blocks(Model(), "Nope")
    with pytest.raises(OptionError, match="Model selects the whole model"):
        find_blocks(Model(), Model)
    assert describe_selector(None) == "auto-detected"
    assert describe_selector((Block, Big)) == "(Block, Big)"


def test_importing_it_does_not_import_torch() -> None:
    code = "import sys, sakura_torch.blocks; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    # nor does the rest of the distribution (plugin modules declare kernels at import)
    code = (
        "import sys, sakura_torch, sakura_torch.native, sakura_torch.native_cuda\n"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
