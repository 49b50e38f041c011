"""The agent runner: admission (staleness quota), agents, pause/resume."""
