"""The process lifecycle around the step engine: plan and workspace, spawn or join, watch, restart, exit."""
