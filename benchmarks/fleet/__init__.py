"""Router, prefill/decode disaggregation and simulated fleets."""
