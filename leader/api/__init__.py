"""HTTP handlers of the leader, grouped by resource."""
