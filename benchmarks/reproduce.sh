#!/usr/bin/env bash
# Re-run the GPU figures of docs/results.md on this machine, every log kept whole in OUTDIR.
#
#   bash benchmarks/reproduce.sh OUTDIR [STAGE...]     stages: report allreduce tests mlp resnet50 workers (default)
#                                                      and the open issues' 2-GPU measurements: scaling spe8
#                                                      transformer p2poff doctor doctor_transformer cudagraphs loops profile monitor onegpu
#                                                      onegpu8 compiled compiled_transformer compiled_long mfu
#                                                      mfu2048 attention
#                                                      (each about 10 minutes or less; one per command; the
#                                                      compiled ones, mfu, mfu2048 and attention on 1 GPU)
#
# Needs TensorFlow with CUDA and 2+ NVIDIA GPUs (PyTorch is optional: the raw NCCL ceiling). The autotune cache
# goes to OUTDIR/cache, so your own stored winner is neither used nor replaced. About 25 minutes on 2x H200.
set -uo pipefail
out=${1:?usage: bash benchmarks/reproduce.sh OUTDIR [report allreduce tests mlp resnet50 workers]}
shift
stages=${*:-report allreduce tests mlp resnet50 workers}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export TF_NVLINK_CACHE_DIR="$out/cache" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0
run() {  # run NAME COMMAND...: stdout and stderr to OUTDIR/NAME.log, the exit status remembered
  local name=$1; shift
  echo "== $name: $*" | tee -a "$out/commands.txt"
  "$@" > "$out/$name.log" 2>&1 || { echo "   $name exited with $?" | tee -a "$out/commands.txt"; status=1; }
}
for stage in $stages; do
  case $stage in
    report) run report "$py" -m tf_nvlink report ;;
    allreduce)
      if "$py" -c "import torch" 2>/dev/null; then
        run raw_nccl "$py" benchmarks/raw_nccl_torch.py --sizes 1M,16M,256M,1G --json "$out/raw_nccl.json"
      fi
      run tune "$py" -m tf_nvlink tune --sizes 16M,256M
      run allreduce "$py" -m tf_nvlink bench --sizes 1M,16M,256M,1G --compare_p2p --json "$out/allreduce.json" ;;
    tests) run pytest_gpu "$py" -m pytest -m gpu -rA --tb=long -p no:cacheprovider ;;
    mlp) run mlp "$py" -m tf_nvlink.tools.training_bench --model mlp --rounds 3 --steps 50 \
           --candidates 1gpu,auto,nccl@split,collective@split,hierarchical@split,auto@nop2p --json "$out/mlp.json" ;;
    resnet50) run resnet50 "$py" -m tf_nvlink.tools.training_bench --model resnet50 --steps 10 \
                --candidates 1gpu,auto,auto@nop2p,stock --json "$out/resnet50.json" ;;
    workers) run workers "$py" -m tf_nvlink.tools.training_bench --model mlp --rounds 3 --steps 50 \
               --candidates auto,workers,workers@nop2p --json "$out/workers.json" ;;
    scaling) run scaling "$py" -m tf_nvlink.tools.training_bench --model resnet50 --rounds 3 --steps 60 \
               --long_steps 240 --warmup_steps 10 --candidates 1gpu,onedevice,auto,auto@ondevice,auto@nocudagraphs \
               --json "$out/scaling.json" ;;
    spe8) run spe8 "$py" -m tf_nvlink.tools.training_bench --model resnet50 --rounds 3 --steps 64 --long_steps 256 \
            --warmup_steps 16 --steps_per_execution 8 --candidates 1gpu,onedevice,auto --json "$out/spe8.json" ;;
    onegpu)  # one GPU: plain Keras against a one-replica tf_nvlink strategy and TensorFlow's OneDeviceStrategy
      run onegpu_transformer "$py" -m tf_nvlink.tools.training_bench --model transformer --rounds 3 --steps 30 \
        --long_steps 120 --warmup_steps 5 --candidates 1gpu,onedevice,auto --json "$out/onegpu_transformer.json"
      run onegpu_resnet50 "$py" -m tf_nvlink.tools.training_bench --model resnet50 --rounds 3 --steps 60 \
        --long_steps 240 --warmup_steps 10 --candidates 1gpu,onedevice,auto --json "$out/onegpu_resnet50.json" ;;
    onegpu8) run onegpu_spe8 "$py" -m tf_nvlink.tools.training_bench --model resnet50 --rounds 3 --steps 64 \
               --long_steps 256 --warmup_steps 16 --steps_per_execution 8 --candidates 1gpu,onedevice,auto \
               --json "$out/onegpu_spe8.json" ;;
    transformer)  # each candidate runs in its own process, so NCCL reads its own NCCL_P2P_DISABLE
      run transformer "$py" -m tf_nvlink.tools.training_bench --model transformer --rounds 3 --steps 30 \
        --warmup_steps 5 --candidates 1gpu,auto,auto@nop2p,auto@bf16grad@nop2p --json "$out/transformer.json" ;;
    p2poff) run p2poff "$py" -m tf_nvlink.tools.training_bench --model resnet50 --rounds 3 --steps 60 \
              --warmup_steps 10 --candidates auto,auto@nop2p,auto@bf16grad@nop2p --json "$out/p2poff.json" ;;
    doctor) run doctor "$py" benchmarks/step_doctor.py --models resnet50 --rounds 3 --json "$out/doctor_resnet50.json" \
              --output_dir "$out/doctor" --trace_out "$out/fixtures" ;;
    doctor_transformer) run doctor_transformer "$py" benchmarks/step_doctor.py --models transformer --rounds 3 \
                          --json "$out/doctor_transformer.json" --output_dir "$out/doctor" ;;
    cudagraphs) run cudagraphs "$py" -m tf_nvlink.tools.training_bench --model resnet50 --rounds 3 --steps 60 \
                  --long_steps 240 --warmup_steps 10 --candidates 1gpu,1gpu@nocudagraphs,auto,auto@nocudagraphs \
                  --json "$out/cudagraphs.json" ;;
    loops) run loops "$py" -m tf_nvlink.tools.training_bench --model resnet50 --rounds 3 --steps 60 --warmup_steps 10 \
             --candidates auto,auto@customloop --json "$out/loops.json" ;;
    profile) run profile "$py" -m tf_nvlink.tools.training_bench --model resnet50 --rounds 1 --steps 30 \
               --candidates 1gpu,onedevice,auto --profile "$out/profile" --json "$out/profile.json" ;;
    compiled) run compiled "$py" benchmarks/compiled_execution.py --models resnet50 --rounds 3 \
                --setups spe=1,per-step,compiled,deep,host-input,resident,torch \
                --json "$out/compiled_r50.json" --output_dir "$out/doctor" ;;
    compiled_transformer) run compiled_transformer "$py" benchmarks/compiled_execution.py --models transformer \
                            --rounds 3 --steps 48 --warmup_steps 16 --setups spe=1,per-step,compiled,restaged,deep,host-input \
                            --json "$out/compiled_tfm.json" --output_dir "$out/doctor" ;;
    compiled_long)  # whole fits long enough that each fit's start weighs little (0.1-0.3 ms a step)
      run compiled_tfm_long "$py" benchmarks/compiled_execution.py --models transformer --rounds 3 --steps 288 \
        --warmup_steps 16 --nodoctor_n --setups spe=1,per-step,compiled --json "$out/compiled_tfm_long.json" \
        --output_dir "$out/doctor_long"
      run compiled_r50_long "$py" benchmarks/compiled_execution.py --models resnet50 --rounds 5 --steps 192 \
        --nodoctor_n --setups spe=1,per-step,compiled,torch --json "$out/compiled_r50_long.json" \
        --output_dir "$out/doctor_long" ;;
    mfu)  # the Transformer at 8 x 512 tokens, fused attention and Keras', against its PyTorch peer (needs torch)
      run mfu "$py" benchmarks/compiled_execution.py --models transformer --setups compiled,unfused,torch \
        --optimizer adamw --rounds 3 --steps 192 --warmup_steps 16 --json "$out/mfu.json" \
        --output_dir "$out/doctor_mfu" ;;
    mfu2048)  # the same at 2 x 2048 tokens
      run mfu2048 "$py" benchmarks/compiled_execution.py --models transformer_2048 --setups compiled,unfused,torch \
        --optimizer adamw --rounds 3 --steps 192 --warmup_steps 16 --json "$out/mfu2048.json" \
        --output_dir "$out/doctor_mfu2048" ;;
    attention)  # attention alone: Keras' against cuDNN's fused, forward and backward, at both shapes
      run attention "$py" benchmarks/fused_attention_micro.py --rounds 3 --json "$out/attention.json" ;;
    monitor) run nvml_read_cost "$py" benchmarks/nvml_read_cost.py --repeats 30 --rounds 3 --load ;;
    *) echo "unknown stage '$stage'; valid: report allreduce tests mlp resnet50 workers scaling spe8 transformer" \
            "p2poff doctor doctor_transformer cudagraphs loops profile monitor onegpu onegpu8 compiled" \
            "compiled_transformer compiled_long mfu mfu2048 attention" >&2; exit 2 ;;
  esac
done
exit $status
