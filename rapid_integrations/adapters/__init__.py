"""What the LangChain and LlamaIndex adapters and `rapid serve` share; framework-free."""
