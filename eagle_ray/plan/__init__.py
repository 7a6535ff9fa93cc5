"""Planning: disk, time and token budgets of a run before it starts."""
