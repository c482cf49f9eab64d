# dp_hf on a CUDA machine: PyTorch's CUDA image, dp_hf and what the recipes need.
#   docker build -t dp_hf .
#   docker run --gpus all -it dp_hf accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml \
#       -m recipes.bert_qnli recipes/configs/bert_qnli.yaml
FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/dp_hf
COPY pyproject.toml README.md LICENSE ./
COPY dp_hf ./dp_hf
COPY recipes ./recipes
COPY bench ./bench
# The image's CUDA torch satisfies dp_hf's torch requirement, so pip keeps it.
RUN pip install ".[recipes,test]"

CMD ["dp-hf", "--help"]
