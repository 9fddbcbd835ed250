"""Media preprocessing of vision-language models: images, videos, placeholders, fetching and limits."""
