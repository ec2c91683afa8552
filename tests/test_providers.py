"""Choosing ONNX Runtime execution providers for workers."""

import pytest


def test_provider_choice_names_what_is_missing():
    from exitplan.worker_image.bundle_runtime import choose_providers

    assert choose_providers("auto")[-1] == "CPUExecutionProvider"
    assert choose_providers("CPUExecutionProvider") == ("CPUExecutionProvider",)
    with pytest.raises(ValueError, match="NoSuchExecutionProvider"):
        choose_providers("NoSuchExecutionProvider,CPUExecutionProvider")
