"""`shunter bench`: one workload, several policies, the same arrivals; metrics, JSON and plots."""
