"""vLLM's offline-inference quickstart with only the import changed:
`from vllm import LLM, SamplingParams` -> `from kvlm import LLM,
SamplingParams` (and a local model: $KVLM_EXAMPLE_MODEL)."""
import os

from kvlm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model=os.environ.get("KVLM_EXAMPLE_MODEL", "./models/stories260K.gguf"))

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
