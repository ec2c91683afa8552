"""The floors the GPU proof holds the data plane to: the whole model run directly, with no router.

- `ort_whole`: the bundle's chain merged into one graph (gpu_chain.merged_model) in one ONNX Runtime
  session per bucket, IO-bound: the least ONNX Runtime itself needs for the model;
- `torch_eager`: the same architecture in PyTorch eager (fp16 on a GPU, fp32 on the CPU), built from the
  source model's Hugging Face config with random weights: the kernels and shapes are the model's, and a
  forward pass takes the same time whatever the weights hold.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from exitplan.api.bundle import read_manifest


def ort_whole(
    merged: Path,
    bundle: Path,
    shapes: Sequence[tuple[int, int]],
    device: str,
    precision: str,
    timer,
    sample_state: Callable,
) -> list[dict]:
    manifest = read_manifest(bundle)
    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    rows = []
    sessions: dict[int, ort.InferenceSession] = {}
    for bucket, batch in shapes:
        row = {"floor": "onnxruntime-whole", "precision": precision, "bucket": bucket, "batch": batch}
        rows.append(row)
        try:
            if bucket not in sessions:
                options = ort.SessionOptions()
                options.log_severity_level = 3
                if manifest.seq_axis is not None:
                    options.add_free_dimension_override_by_name("seq", bucket)
                sessions[bucket] = ort.InferenceSession(str(merged), options, providers=providers)
            session = sessions[bucket]
            state = sample_state(manifest, batch, bucket)
            output = session.get_outputs()[0].name

            def call(s=session, st=state, out=output) -> np.ndarray:
                binding = s.io_binding()
                for name, array in st.items():
                    binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, device, 0))
                binding.bind_output(out, device, 0)
                s.run_with_iobinding(binding)
                return np.asarray(binding.get_outputs()[0].numpy())

            row["ms"], row["p90_ms"] = timer.time(call)
        except Exception as err:  # recorded: the proof goes on
            row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
    return rows


def torch_eager(config: Path, bundle: Path, shapes: Sequence[tuple[int, int]], device: str, timer) -> list[dict]:
    manifest = read_manifest(bundle)
    precision = "fp16" if device == "cuda" else "fp32"
    rows = [{"floor": "torch-eager", "precision": precision, "bucket": b, "batch": n} for b, n in shapes]
    try:
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification
    except ImportError as err:
        for row in rows:
            row["error"] = f"PyTorch or transformers is missing: {err}"
        return rows
    try:
        hf = AutoConfig.for_model(**json.loads(config.read_text()))
        hf.num_labels = len(manifest.labels)
        model = AutoModelForSequenceClassification.from_config(hf).eval()
        dtype = torch.float16 if device == "cuda" else torch.float32
        model = model.to(device=device, dtype=dtype)
    except Exception as err:
        for row in rows:
            row["error"] = f"building the model from {config.name} failed: {type(err).__name__}: {err}"
        return rows
    for row in rows:
        bucket, batch = row["bucket"], row["batch"]
        ids = torch.randint(1000, 2000, (batch, bucket), device=device)
        mask = torch.ones_like(ids)

        def call(i=ids, m=mask) -> np.ndarray:
            with torch.inference_mode():
                logits = model(input_ids=i, attention_mask=m).logits
            return logits.float().cpu().numpy()  # the answer comes back to the host, as the chain's does

        try:
            row["ms"], row["p90_ms"] = timer.time(call)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
    return rows
