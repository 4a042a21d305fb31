# bench: ours against Megatron-Core 0.19.2 at its best single-GPU settings (peer-mcore-*; docs/performance.md
# says which), BF16 and FP8 delayed, at the 172B layer shape (172b-slice) and the whole llmjp3-1.8b, and in BF16
# alone (LLM-jp-4 trains in BF16) at llmjp4-8b-slice (4 layers of the LLM-jp-4 8B, its 196,608-row head): one
# `llmjp-ds bench` call, each variant in a fresh process, GAS 8, 3 timed steps. ARGS: more `llmjp-ds bench`
# arguments; a --shapes, --variants or --steps among them replaces the one here (llmjp4-8b-slice keeps its BF16
# pair unless ARGS give it a --shape-variants of its own).
shapes=172b-slice,llmjp3-1.8b,llmjp4-8b-slice
bench bench --shapes "$shapes" --steps 3 --warmup 2 \
  --shape-variants llmjp4-8b-slice=ours-bf16,peer-mcore-bf16 \
  --variants ours-bf16,peer-mcore-bf16,ours-fp8-delayed,peer-mcore-fp8-param "$@"
# the same 1.8B row with the health monitor's gate before each update (health.loss.action=skip: the step's loss is
# reduced over the ranks and read before the last backward): its cost beside the row above, in the same call; not
# run where ARGS' --shapes (the last one, as `llmjp-ds bench` reads them) leave out llmjp3-1.8b
for (( i = 1; i <= $#; i++ )); do
  case ${!i} in
    --shapes=*) shapes=${!i#--shapes=} ;;
    --shapes) j=$(( i + 1 )); shapes=${!j:-} ;;
  esac
done
[[ ,$shapes, == *,llmjp3-1.8b,* ]] &&
  bench bench-health --shapes llmjp3-1.8b --steps 3 --warmup 2 --variants ours-bf16 --set health.loss.action=skip
