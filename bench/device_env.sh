# Sourced by the bench/gpu_*.sh device scripts: what a lent machine is (date, GPU, jax, torch when asked),
# after installing this tree there without the network. Prints to stdout; callers redirect it.
device_env() {
    date
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2 || true
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
    if [[ "${1:-}" == torch ]]; then
        python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
        python3 -c "import transformers; print('transformers', transformers.__version__)"  # parity references
    fi
}

# The folder whose files come back from the device machine ($OUT, required), and unbuffered Python output.
device_out() {
    : "${OUT:?OUT must name the folder to return files from}"
    export PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
}

# ../shared/data (WikiText-2 and the task sets, not the corpus) where the device machine lacks it, for runs there
# given `MOEJAX_DATA=../shared/data` (the full task sets; the suite itself reads its own copies in tests/data).
# Here, before the call: `bash bench/device_env.sh --pack-shared` writes .shared-data.tar.xz (git-ignored,
# ~4 MB); carry it, and the device script unpacks it beside the checkout.
shared_data() {
    if [[ ! -d ../shared/data ]] && [[ -f .shared-data.tar.xz ]]; then
        mkdir -p ../shared && tar xJf .shared-data.tar.xz -C ../shared && echo "unpacked ../shared/data"
    fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]] && [[ "${1:-}" == --pack-shared ]]; then
    cd "$(dirname "$0")/.." && tar cJf .shared-data.tar.xz.tmp -C ../shared --exclude data/corpus data \
        && mv .shared-data.tar.xz.tmp .shared-data.tar.xz && ls -la .shared-data.tar.xz
fi
