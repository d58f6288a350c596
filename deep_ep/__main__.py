"""``python -m deep_ep``: say which deep_ep this is (commlib's compatibility layer) and whether a real
DeepEP is visible beside it."""
import deep_ep

print(f"deep_ep -> commlib {deep_ep.__version__} (compatibility layer) at {deep_ep.__file__}")
real = deep_ep.find_real_deep_ep()
print("real DeepEP visible: " + ("; ".join(real) if real else "none"))
