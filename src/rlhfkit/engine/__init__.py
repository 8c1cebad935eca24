"""Process, device and checkpoint glue around accelerate (imported lazily by the trainers)."""
