"""Models a user might bring, built and trained here from what packages ship (no hub downloads):

- a small residual CNN trained on scikit-learn's digits (scaled to 32x32), exported as one ONNX file
  with its input named `pixels` [N, 1, 32, 32] and TF-style asymmetric padding before a stride-2 conv;
- the MiniLM encoder with a classification head over mean-pooled states (the head of the MiniLM test
  bundle, trained on the tweets), exported whole with inputs `input_ids` and `attention_mask`.

Each comes with its DATA.npz (one array per model input keyed by name, and `label`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

nn = torch.nn
OPSET = 17


def export(module: nn.Module, example: tuple, path: Path, input_names: list[str], axes: dict) -> None:
    module.eval()
    with torch.no_grad():
        torch.onnx.export(
            module,
            example,
            str(path),
            input_names=input_names,
            output_names=["logits"],
            dynamic_axes=axes,
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class DigitsResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.res1 = ResBlock(32)
        self.down = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(32, 64, 3, stride=2), nn.ReLU())
        self.res2 = ResBlock(64)
        self.res3 = ResBlock(64)
        self.fc = nn.Linear(64, classes)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.res3(self.res2(self.down(self.res1(self.stem(pixels)))))
        return self.fc(x.mean(dim=(2, 3)))


def train_classifier(net: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int, batch: int = 50) -> nn.Module:
    """`net` trained in place on (x, y): Adam, `epochs` passes of consecutive batches, seed 0."""
    torch.manual_seed(0)
    optimiser = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(epochs):
        for start in range(0, len(y), batch):
            optimiser.zero_grad()
            rows = slice(start, start + batch)
            loss = nn.functional.cross_entropy(net(torch.from_numpy(x[rows])), torch.from_numpy(y[rows]))
            loss.backward()
            optimiser.step()
    return net.eval()


def digits_cnn(directory: Path, epochs: int = 4, seed: int = 0) -> tuple[Path, Path]:
    """(model.onnx, data.npz) of a residual CNN trained on the digits scaled up to 32x32 (so blocks
    cost more than a call into ONNX Runtime); the data is the digits it was not trained on."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = np.kron(digits.images.astype(np.float32) / 16.0, np.ones((4, 4), dtype=np.float32))[:, None, :, :]
    y = digits.target.astype(np.int64)
    torch.manual_seed(seed)
    net = DigitsResNet()
    optimiser = torch.optim.Adam(net.parameters(), lr=3e-3)
    order = np.random.default_rng(seed).permutation(len(y))
    train = order[: int(0.7 * len(y))]
    net.train()
    for _ in range(epochs):
        for start in range(0, train.size, 64):
            rows = train[start : start + 64]
            optimiser.zero_grad()
            loss = nn.functional.cross_entropy(net(torch.from_numpy(x[rows])), torch.from_numpy(y[rows]))
            loss.backward()
            optimiser.step()
    directory.mkdir(parents=True, exist_ok=True)
    model_path, data_path = directory / "digits-resnet.onnx", directory / "digits.npz"
    export(net, (torch.from_numpy(x[:2]),), model_path, ["pixels"], {"pixels": {0: "n"}, "logits": {0: "n"}})
    held = order[int(0.7 * len(y)) :]  # the user's data: samples the model was not trained on
    np.savez(data_path, pixels=x[held], label=y[held])
    return model_path, data_path


class MiniLMClassifier(nn.Module):
    """The whole encoder (explicit token types and positions, the additive mask computed once),
    mean pooling and a linear head, as one graph."""

    def __init__(self, encoder: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.embeddings = encoder.embeddings
        self.layers = encoder.encoder.layer
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from exitplan.prepare.minilm import additive_mask, mean_pool

        positions = torch.arange(input_ids.shape[1], dtype=torch.long).unsqueeze(0).expand_as(input_ids)
        h = self.embeddings(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids), position_ids=positions)
        mask = additive_mask(attention_mask)
        for layer in self.layers:
            out = layer(h, mask)
            h = out[0] if isinstance(out, tuple) else out
        return self.head(mean_pool(h, attention_mask))


def minilm_classifier(directory: Path, minilm_bundle: Path, n: int = 480, length: int = 32) -> tuple[Path, Path]:
    """(model.onnx, data.npz): MiniLM with the test bundle's trained head; the data is `n` of the
    bundle's held-out tweets tokenized and padded to `length`."""
    from tokenizers import Tokenizer

    from exitplan.prepare.minilm import load_encoder

    heads = np.load(minilm_bundle / "data" / "head.npz")  # the head the preset's build trained
    head = nn.Linear(heads["weight"].shape[1], heads["weight"].shape[0])
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(heads["weight"]))
        head.bias.copy_(torch.from_numpy(heads["bias"]))
    net = MiniLMClassifier(load_encoder(), head)
    held = np.load(minilm_bundle / "data" / "heldout.npz")
    tokenizer = Tokenizer.from_file(str(minilm_bundle / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=length)
    tokenizer.enable_padding(length=length)
    encoded = tokenizer.encode_batch([str(t) for t in held["text"][:n]])
    ids = np.array([e.ids for e in encoded], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
    directory.mkdir(parents=True, exist_ok=True)
    model_path, data_path = directory / "minilm-tweets.onnx", directory / "tweets.npz"
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}, "logits": {0: "batch"}}
    example = (torch.from_numpy(ids[:2]), torch.from_numpy(mask[:2]))
    export(net, example, model_path, ["input_ids", "attention_mask"], axes)
    np.savez(data_path, input_ids=ids, attention_mask=mask, label=held["label"][:n].astype(np.int64))
    return model_path, data_path
