"""Taylor-Calibrate: teacher capture and statistics, Phase 1, Phase 2, the KL stage, their settings and named
budgets (config, budget), and pipeline.calibrate, which chains them."""
