"""llama-cpp-python's README examples (basic completion, chat, streaming),
with only the import changed: `from llama_cpp import Llama` -> `from kvlm
import Llama`. The model: $KVLM_EXAMPLE_MODEL (a small GGUF file)."""
import os

from kvlm import Llama

llm = Llama(
    model_path=os.environ.get("KVLM_EXAMPLE_MODEL", "./models/stories260K.gguf"),
    # n_gpu_layers=-1, # Uncomment to use GPU acceleration
    # seed=1337, # Uncomment to set a specific seed
    # n_ctx=2048, # Uncomment to increase the context window
)
output = llm(
    "Q: Name the planets in the solar system? A: ",  # Prompt
    max_tokens=32,  # Generate up to 32 tokens, set to None to generate up to the end of the context window
    stop=["Q:", "\n"],  # Stop generating just before the model would generate a new question
    echo=True  # Echo the prompt back in the output
)  # Generate a completion, can also call create_completion
print(output)

print(llm.create_chat_completion(
    messages=[
        {"role": "system", "content": "You are an assistant who perfectly describes images."},
        {"role": "user", "content": "Describe this image in detail please."}
    ]
))

for chunk in llm("Once upon a time", max_tokens=32, stream=True):
    print(chunk["choices"][0]["text"], end="", flush=True)
print()
