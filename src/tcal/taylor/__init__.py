"""Taylor-Calibrate: teacher capture and statistics, Phase 1, Phase 2, and pipeline.calibrate, which chains them."""
