"""fabriclite.checkpoint.safe_loading in one process: None means True, torch < 2.10 is named, and what
fabriclite.add_safe_globals allowed loads with weights_only=True during fabriclite's loads only."""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest
import torch

import fabriclite
from fabriclite.checkpoint.safe_loading import resolve_weights_only, torch_load, vulnerable_torch_message


@dataclass
class SavedConfig:
    lr: float


def test_weights_only_none_means_true_and_bad_values_are_refused():
    assert resolve_weights_only(None) is True and resolve_weights_only(True) is True
    assert resolve_weights_only(False) is False
    with pytest.raises(TypeError, match="weights_only='yes'"):
        resolve_weights_only("yes")


def test_old_torch_is_named_with_cve_2026_24747():
    message = vulnerable_torch_message("2.9.1+cpu")
    assert message is not None and "CVE-2026-24747" in message and "torch>=2.10" in message and "2.9.1" in message
    assert vulnerable_torch_message("2.10.0") is None and vulnerable_torch_message("2.13.0+cu128") is None


def test_the_classes_add_safe_globals_allowed_load_during_fabriclites_loads_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    path = tmp_path / "config.pt"
    torch.save({"config": SavedConfig(0.5)}, path)
    with pytest.raises(pickle.UnpicklingError, match="SavedConfig"):
        torch_load(path)  # None: True, the variable notwithstanding
    fabriclite.add_safe_globals([SavedConfig])
    assert torch_load(path) == {"config": SavedConfig(0.5)}
    assert SavedConfig not in torch.serialization.get_safe_globals()  # registered for that load only
    assert torch_load(path, weights_only=False) == {"config": SavedConfig(0.5)}
