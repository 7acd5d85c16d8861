BT=500 bash .dev/call.sh "torch 1F1B 4; pf 1f1b 4 16 plan mem=13.7; pf 1f1b 8 8 spot" 150   # call C, same machine as B
