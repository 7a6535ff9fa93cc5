"""Operating a cluster and a running job: connecting to Ray, live pool scaling, dashboard metrics."""
