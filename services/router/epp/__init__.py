"""The Gateway API Inference Extension endpoint picker: Envoy ext_proc in front of the router's scheduler."""
