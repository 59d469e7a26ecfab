"""SGLang behind the engine boundary, for GPU cells. SGLang itself is imported lazily
(`backend.load_sglang`), so this package imports without it."""
