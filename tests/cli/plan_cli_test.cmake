# `shardcast plan` on the shipped example layouts: JSON keys present, exit codes for bad input.
function(run expect_rc)
  execute_process(COMMAND ${CLI} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL expect_rc)
    message(FATAL_ERROR "shardcast ${ARGN}: exit ${rc}, expected ${expect_rc}\n${out}\n${err}")
  endif()
  set(OUT "${out}${err}" PARENT_SCOPE)
endfunction()

set(SRC ${EXAMPLES}/trainer_fsdp2_tp4.json)
set(DST ${EXAMPLES}/vllm_tp4_dp2.json)

run(0 plan --src ${SRC} --dst ${DST} --json --nic-gbps 100 --local-gbps 1000)
foreach(key tensors bytes_needed network_bytes network_bytes_lower_bound local_bytes ops
            node_ingress_bytes node_egress_bytes max_node_ingress_bytes max_node_egress_bytes
            predicted_seconds plan_ms baselines rank_pull gather_broadcast)
  string(FIND "${OUT}" "\"${key}\"" pos)
  if(pos EQUAL -1)
    message(FATAL_ERROR "key ${key} missing from --json output:\n${OUT}")
  endif()
endforeach()
string(JSON nb GET "${OUT}" network_bytes)
string(JSON lb GET "${OUT}" network_bytes_lower_bound)
if(NOT nb EQUAL lb)
  message(FATAL_ERROR "network_bytes ${nb} != lower bound ${lb}")
endif()
string(JSON ingress GET "${OUT}" node_ingress_bytes infer-node-0)

run(0 plan --src ${SRC} --dst ${DST})
string(FIND "${OUT}" "lower bound" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "summary lacks the lower bound line:\n${OUT}")
endif()

run(2 plan --src ${SRC})                                       # usage: --dst missing
run(2 plan --src ${SRC} --dst ${DST} --nic-gbps -1)            # usage: bad number
run(3 plan --src ${SRC} --dst /nonexistent/layout.json)        # invalid input: no such file
string(FIND "${OUT}" "/nonexistent/layout.json" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "error does not name the file:\n${OUT}")
endif()
run(0 plan --src ${DST} --dst ${SRC} --json)                   # the reverse direction plans too

file(WRITE ${TMP}/bad_dtype.json [=[{"group":"x","mesh":{"shape":[2]},"ranks_per_node":1,
  "tensors":[{"name":"w","shape":[4],"dtype":"bf16"}]}]=])
run(3 plan --src ${TMP}/bad_dtype.json --dst ${DST})
string(FIND "${OUT}" "tensor \"w\": unknown dtype \"bf16\"" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "validation error not shown:\n${OUT}")
endif()
