"""Planning: the target and workload, memory math, tensor/pipeline layout, engine choice, launch flags."""
