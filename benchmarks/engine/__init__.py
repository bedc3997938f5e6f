"""Engine speed and quantization quality."""
