"""Everything that touches tensors: loading, the model, attention, sampling."""
