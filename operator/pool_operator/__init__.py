"""kvferry's InferencePool operator: CRD models, pure rendering, kopf handlers and autoscaling."""
